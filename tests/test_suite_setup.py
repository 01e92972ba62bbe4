"""The suite's own set-up (tests/conftest.py): the stack limit its processes run with."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

from tests.conftest import STACK_BYTES


def _default_thread_stack_bytes() -> int:
    """glibc's default stack size for new threads (fixed when the process starts, from its RLIMIT_STACK)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t is 56 bytes on x86-64 glibc
    assert libc.pthread_getattr_default_np(attr) == 0
    size = ctypes.c_size_t()
    assert libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0
    return size.value


def test_stack_limit_is_raised():
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    want = STACK_BYTES if hard == resource.RLIM_INFINITY else min(STACK_BYTES, hard)
    assert soft == resource.RLIM_INFINITY or soft >= want, (soft, hard)
    if os.environ.get("PYTEST_XDIST_WORKER") and soft != resource.RLIM_INFINITY:
        # a worker started after the controller raised the limit: its threads (XLA's compile threads among them)
        # get stacks of that size too
        assert _default_thread_stack_bytes() >= want, _default_thread_stack_bytes()
