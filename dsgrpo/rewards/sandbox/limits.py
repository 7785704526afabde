"""What a contained process may spend and which system calls it may make: rlimits, and seccomp filters written as
classic BPF by hand (standard library only: no libseccomp).

The filters deny (EPERM, as an unprivileged caller would see) the calls that reach past the sandbox's namespaces
or outlive the run: debugging another process (ptrace, process_vm_*, pidfd_getfd), the kernel keyring (keyctl,
add_key, request_key: keys outlive processes and uids are reused), System V IPC (segments outlive processes),
new namespaces and mounts (unshare, setns, clone with a namespace flag, the mount API), watching files (inotify,
fanotify: both cells read one copy of the standard library, so a watch would show the program which modules a
test imports, and the host's own opens), and kernel interfaces no program under test needs (bpf, perf_event_open,
userfaultfd, io_uring, modules, kexec, ...). The x32 ABI and other architectures' calls kill the process. A test's
own process (the checker's) also may not create processes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import struct


# ---------------------------------------------------------------------------------------------- rlimits
def set_rlimits(cpu_s: int, address_space: int, file_bytes: int, files: int = 256, processes: int = 0) -> None:
    for res, value in (
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, address_space),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, files),
    ):
        resource.setrlimit(res, (value, value))
    if processes:  # only where the uid (or user namespace) is this run's alone: the count is the run's processes
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


# ---------------------------------------------------------------------------------------------- seccomp
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
SYSCALLS = {  # from the kernel's syscall tables (arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic)
    "x86_64": {
        "shmget": 29,
        "shmat": 30,
        "shmctl": 31,
        "clone": 56,
        "fork": 57,
        "vfork": 58,
        "semget": 64,
        "semop": 65,
        "semctl": 66,
        "shmdt": 67,
        "msgget": 68,
        "msgsnd": 69,
        "msgrcv": 70,
        "msgctl": 71,
        "ptrace": 101,
        "syslog": 103,
        "pivot_root": 155,
        "acct": 163,
        "mount": 165,
        "umount2": 166,
        "swapon": 167,
        "swapoff": 168,
        "reboot": 169,
        "init_module": 175,
        "delete_module": 176,
        "quotactl": 179,
        "semtimedop": 220,
        "kexec_load": 246,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "inotify_init": 253,
        "inotify_add_watch": 254,
        "unshare": 272,
        "move_pages": 279,
        "inotify_init1": 294,
        "perf_event_open": 298,
        "fanotify_init": 300,
        "fanotify_mark": 301,
        "name_to_handle_at": 303,
        "open_by_handle_at": 304,
        "setns": 308,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "finit_module": 313,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
    },
    "aarch64": {
        "inotify_init1": 26,
        "inotify_add_watch": 27,
        "umount2": 39,
        "mount": 40,
        "pivot_root": 41,
        "quotactl": 60,
        "acct": 89,
        "unshare": 97,
        "kexec_load": 104,
        "init_module": 105,
        "delete_module": 106,
        "syslog": 116,
        "ptrace": 117,
        "reboot": 142,
        "msgget": 186,
        "msgctl": 187,
        "msgrcv": 188,
        "msgsnd": 189,
        "semget": 190,
        "semctl": 191,
        "semtimedop": 192,
        "semop": 193,
        "shmget": 194,
        "shmctl": 195,
        "shmat": 196,
        "shmdt": 197,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "clone": 220,
        "swapon": 224,
        "swapoff": 225,
        "move_pages": 239,
        "perf_event_open": 241,
        "fanotify_init": 262,
        "fanotify_mark": 263,
        "name_to_handle_at": 264,
        "open_by_handle_at": 265,
        "setns": 268,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "finit_module": 273,
        "bpf": 280,
        "userfaultfd": 282,
        "kexec_file_load": 294,
    },
}
COMMON = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
}
DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "process_madvise",
    "move_pages",
    "keyctl",
    "add_key",
    "request_key",
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "quotactl",
    "name_to_handle_at",
    "open_by_handle_at",
    "inotify_init",
    "inotify_init1",
    "inotify_add_watch",
    "fanotify_init",
    "fanotify_mark",
)
# calls an architecture never had (aarch64 was born with inotify_init1 only): nothing to deny there
NOT_EVERYWHERE = {"inotify_init"}
CLONE_THREAD = 0x00010000
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def _errno(e: int) -> int:
    return 0x00050000 | e


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str, new_processes: bool) -> bytes:
    """The BPF program: seccomp_data is {int nr; u32 arch; u64 ip; u64 args[6]} (offsets 0, 4, 8, 16)."""
    if machine not in AUDIT_ARCH:
        raise OSError(errno.ENOSYS, f"no seccomp filter known for {machine}")
    numbers = dict(SYSCALLS[machine], **COMMON)
    prog = [
        _insn(_LD_W_ABS, 4),
        _insn(_JEQ, AUDIT_ARCH[machine], 1, 0),
        _insn(_RET, RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0),
    ]
    if machine == "x86_64":  # the x32 ABI reaches the same kernel through other numbers
        prog += [_insn(_JGE, X32_SYSCALL_BIT, 0, 1), _insn(_RET, RET_KILL_PROCESS)]
    for name in DENIED:
        if name not in numbers and name in NOT_EVERYWHERE:
            continue
        prog += [_insn(_JEQ, numbers[name], 0, 1), _insn(_RET, _errno(errno.EPERM))]
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes glibc fall back to clone
    prog += [_insn(_JEQ, numbers["clone3"], 0, 1), _insn(_RET, _errno(errno.ENOSYS))]
    # clone: its flags are the first argument (low 32 bits at offset 16 on a little-endian machine)
    clone = [_insn(_LD_W_ABS, 16), _insn(_JSET, CLONE_NAMESPACES, 0, 1), _insn(_RET, _errno(errno.EPERM))]
    if not new_processes:  # threads only
        clone += [_insn(_JSET, CLONE_THREAD, 1, 0), _insn(_RET, _errno(errno.EPERM))]
    clone.append(_insn(_RET, RET_ALLOW))
    prog += [_insn(_JEQ, numbers["clone"], 0, len(clone))] + clone
    if not new_processes and "fork" in numbers:
        for name in ("fork", "vfork"):
            prog += [_insn(_JEQ, numbers[name], 0, 1), _insn(_RET, _errno(errno.EPERM))]
    prog.append(_insn(_RET, RET_ALLOW))
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp(new_processes: bool = True) -> None:
    """Install the filter on this process (and everything it forks). NO_NEW_PRIVS must already be set."""
    program = filter_program(os.uname().machine, new_processes)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {os.strerror(err)}")
