"""`python -m dsgrpo.train CONFIG.yaml [--key value ...]`: the entry point for launchers
(`deepspeed --num_gpus N --module dsgrpo.train ...`, `torchrun -m dsgrpo.train ...`)."""

import sys

from .cli import run_reporting_errors, train
from .process_exit import leave

if __name__ == "__main__":
    leave(run_reporting_errors(train, sys.argv[1:]))  # a crash still exits the usual way, with its traceback
