# Sourced by train.sh and slurm/train.sbatch: choose the interpreter the ranks run.
#   dsgrpo_python CHECKOUT    sets PYTHON (and PYTHON_FROM, what chose it) and checks it can run dsgrpo
# PYTHON from the environment wins; otherwise the checkout's .venv (what `make setup` builds) when it exists, so
# a newcomer need not activate it; otherwise `python` on PATH. An interpreter without torch, deepspeed or dsgrpo
# stops the launch here, saying which, rather than in every rank after the launcher (or Slurm) started them.
dsgrpo_python() {
  local checkout=$1 missing
  if [[ -n ${PYTHON:-} ]]; then
    PYTHON_FROM="PYTHON"
  elif [[ -x $checkout/.venv/bin/python ]]; then
    PYTHON=$checkout/.venv/bin/python
    PYTHON_FROM="the checkout's .venv"
    export PATH="$checkout/.venv/bin:$PATH"  # its tools too (ninja for DeepSpeed's op builds, the deepspeed launcher)
  else
    PYTHON=python
    PYTHON_FROM="PATH (no .venv in $checkout)"
  fi
  missing=$("$PYTHON" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "deepspeed", "dsgrpo") if u.find_spec(m) is None))' 2>&1) || missing="a working interpreter ($missing)"
  if [[ -n $missing ]]; then
    echo "dsgrpo: error: $PYTHON (from $PYTHON_FROM) lacks $missing. Run \`make setup\` (CPU) or \`make setup-gpu\` (GPU) in" \
         "$checkout, or set PYTHON=/path/to/python." >&2
    return 2
  fi
  export PYTHON
}
