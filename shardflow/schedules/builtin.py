"""The built-in schedules by the names a config gives them."""

from __future__ import annotations

from collections.abc import Callable

from shardflow.schedules.lockstep import one_f_one_b_fused, zb_fused
from shardflow.schedules.table import Schedule
from shardflow.schedules.whole_backward import gpipe, interleaved_1f1b, one_f_one_b
from shardflow.schedules.zero_bubble import zb_h1, zb_v

BUILTIN: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b-fused": one_f_one_b_fused,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "zb-fused": zb_fused,
}
_CHUNKS = {"gpipe": 1, "1f1b": 1, "1f1b-fused": 1, "zb-h1": 1, "zb-v": 2, "zb-fused": 1}


def by_name(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The built-in schedule a config names: "gpipe", "1f1b", "1f1b-fused", "interleaved" (v chunks
    per stage, 2 by default), "zb-h1" or "zb-v"."""
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key not in BUILTIN:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; the built-in ones are "
            f"{', '.join(BUILTIN)} (or pass a Schedule of your own)"
        )
    if key == "interleaved":
        return interleaved_1f1b(p, m, 2 if v is None else v)
    if v is not None and v != _CHUNKS[key]:
        raise ValueError(
            f"schedule {key!r} runs {_CHUNKS[key]} chunk(s) per stage, got v = {v}; "
            f"v chooses the chunks of 'interleaved' only"
        )
    return BUILTIN[key](p, m)
