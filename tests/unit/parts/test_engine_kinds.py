"""A profile's kind, and the engine each kind has: a bare profile's has no method it cannot serve."""

from __future__ import annotations

import inspect
import json

from gpuswapd.config import ProfileKind
from gpuswapd.parts.engine import BareEngine, ContainerEngine, Engine
from gpuswapd.record import WindowRecord
from tests.fakes import PROFILE_CONFIG


def _methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_a_bare_engine_has_what_every_engine_has_and_nothing_that_only_a_container_does() -> None:
    common = _methods(Engine)
    assert common, "the Engine protocol names no method"
    assert _methods(BareEngine) == common
    assert common <= _methods(ContainerEngine)
    only_a_container = {"bring_up", "wait_serving", "warm", "offers_sleep", "sleep", "wake", "canary"}
    assert only_a_container <= _methods(ContainerEngine) - common


def test_the_kind_is_an_enum_that_the_toml_status_and_history_say_as_before() -> None:
    kinds = {p.name: p.kind for p in PROFILE_CONFIG.all_profiles()}
    assert kinds == {"default": ProfileKind.ENGINE, "eval": ProfileKind.ENGINE, "bare": ProfileKind.BARE}
    assert all(type(kind) is ProfileKind for kind in kinds.values())
    assert [p.name for p in PROFILE_CONFIG.engine_profiles()] == ["default", "eval"]
    assert json.dumps({"kind": PROFILE_CONFIG.profile("bare").kind}) == '{"kind": "bare"}'

    rec = WindowRecord.new()
    rec.profile, rec.kind = "bare", PROFILE_CONFIG.profile("bare").kind
    line = json.dumps(rec.to_dict())
    assert '"kind": "bare"' in line
    again = WindowRecord.from_dict(json.loads(line))
    assert again.kind is ProfileKind.BARE
    old = {k: v for k, v in rec.to_dict().items() if k != "kind"}  # a record written before kinds existed
    assert WindowRecord.from_dict(old).kind is ProfileKind.ENGINE
