"""Random packet loss without netem: a tc classifier in eBPF that drops a share of packets.

The kernels here are built without netem (`CONFIG_NET_SCH_NETEM` unset) and without the
gact action, but with `CONFIG_NET_CLS_BPF` and the BPF syscall. So a six-instruction
program of type SCHED_CLS, attached in direct-action mode to an interface's egress
(`clsact`), draws `bpf_get_prandom_u32()` per packet and returns TC_ACT_SHOT for the
chosen share. No compiler is needed: the instructions are assembled here, loaded with the
`bpf(2)` syscall through ctypes, and pinned in a bpffs mount for `tc` to attach by path.
"""

from __future__ import annotations

import ctypes
import struct

__all__ = ["load_and_pin"]

_SYS_BPF = 321  # x86_64
_BPF_PROG_LOAD, _BPF_OBJ_PIN = 5, 6
_PROG_TYPE_SCHED_CLS = 3
_FUNC_GET_PRANDOM_U32 = 7
_TC_ACT_OK, _TC_ACT_SHOT = 0, 2
_ATTR_BYTES = 128


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _program(drop_share: float) -> bytes:
    """Drop a packet when a fresh random u32 falls below `drop_share` of its range."""
    threshold = min(int(drop_share * 2**32), 2**31 - 1)  # an imm is signed 32-bit
    return b"".join(
        [
            _insn(0x85, imm=_FUNC_GET_PRANDOM_U32),  # call: r0 = random u32
            _insn(0x35, dst=0, off=2, imm=threshold),  # if r0 >= threshold: goto keep
            _insn(0xB7, dst=0, imm=_TC_ACT_SHOT),  # r0 = drop
            _insn(0x95),  # exit
            _insn(0xB7, dst=0, imm=_TC_ACT_OK),  # keep: r0 = pass
            _insn(0x95),  # exit
        ]
    )


def _bpf(cmd: int, attr: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr.ljust(_ATTR_BYTES, b"\0"), _ATTR_BYTES)
    rc = libc.syscall(_SYS_BPF, cmd, buf, _ATTR_BYTES)
    if rc < 0:
        raise OSError(ctypes.get_errno(), f"bpf({cmd}) failed")
    return int(rc)


def load_and_pin(drop_share: float, path: str) -> None:
    """Load the dropping program and pin it at `path` (inside a bpffs mount)."""
    code = _program(drop_share)
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(4096)
    load = struct.pack(
        "<IIQQIIQI",
        _PROG_TYPE_SCHED_CLS,
        len(code) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license_),
        1,  # log level: the verifier says why, if it refuses
        len(log),
        ctypes.addressof(log),
        0,
    )
    try:
        fd = _bpf(_BPF_PROG_LOAD, load)
    except OSError as exc:
        raise OSError(exc.errno, f"loading the loss program: {log.value.decode(errors='replace')}") from exc
    where = ctypes.create_string_buffer(path.encode())
    try:
        _bpf(_BPF_OBJ_PIN, struct.pack("<QI", ctypes.addressof(where), fd))
    finally:
        libc = ctypes.CDLL(None)
        libc.close(fd)
