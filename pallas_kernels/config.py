"""Kernel launch configurations: one check for every kernel, so that a bad choice fails loudly instead of leaving
part of an output unwritten (a block that does not divide its axis) or failing deep inside the Triton lowering."""

from __future__ import annotations


class StaticConfig(tuple):
    """A caller's config dict as a jitted kernel's static argument: its (key, value) items, sorted (a list value as
    a tuple), hashable, and equal only to a config with the same keys, values and value types. jit's cache compares
    static arguments with ==, under which {"x": True} equals {"x": 1} and 2.0 equals 2: a value that `merged_config`
    refuses would reuse an equal value's compiled kernel and never be checked."""

    def __new__(cls, config):
        return super().__new__(cls, sorted((key, tuple(val) if isinstance(val, list) else val)
                                           for key, val in dict(config).items()))

    def _typed(self):
        return tuple((key, _typed(val)) for key, val in self)

    def __eq__(self, other):
        return isinstance(other, StaticConfig) and self._typed() == other._typed()

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self._typed())


def _typed(val):
    return tuple(_typed(v) for v in val) if isinstance(val, tuple) else (type(val).__name__, val)


def static_config(config):
    """None, or the config as a `StaticConfig`."""
    return None if config is None else StaticConfig(config)


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def merged_config(kernel: str, defaults: dict, config, *, blocks: dict[str, int] | None = None,
                  pow2: tuple[str, ...] = (), extra: tuple[str, ...] = (), min_block: int = 16) -> dict:
    """`defaults` updated with `config` (a dict or a tuple of items), checked.

    blocks: {key: axis length}: the block min(cfg[key], length) must be a power of two >= `min_block` (16: the
    smallest dot operand; 8 for kernels without dots) dividing the axis.
    pow2: keys that must be powers of two >= 16 (tiles of padded axes). extra: further keys allowed.
    """
    cfg = dict(defaults)
    cfg.update(dict(config or ()))
    unknown = set(cfg) - set(defaults) - set(extra)
    if unknown:
        raise ValueError(f"{kernel}: unknown config keys {sorted(unknown)}; known: {sorted(defaults)}")
    for key, length in (blocks or {}).items():
        b = min(cfg[key], length)
        if b < min_block or not _pow2(b) or length % b:
            raise ValueError(f"{kernel}: {key}={cfg[key]} gives a block of {b} on an axis of {length}: it must be a "
                             f"power of two >= {min_block} dividing the axis")
    for key in pow2:
        if cfg[key] < 16 or not _pow2(cfg[key]):
            raise ValueError(f"{kernel}: {key}={cfg[key]} must be a power of two >= 16")
    for key in ("num_warps", "num_stages", "warps_prep", "stages_prep", "warps_state", "stages_state", "warps_out",
                "stages_out", "warps_apply", "warps_replay_intra"):
        if key in cfg and (not isinstance(cfg[key], int) or cfg[key] < 1):
            raise ValueError(f"{kernel}: {key}={cfg[key]!r} must be a positive integer")
    return cfg
