"""Typed settings: one name per setting, reachable by its dotted path, checked on the way in."""

import pytest

from sekv_core.config import MethodSettings, StoreSettings, override, setting_names
from sekv_core.errors import SekvError


def test_override_reaches_nested_settings_and_parses_their_types():
    s = override(
        MethodSettings(),
        ["neighbours=0", "store.segment.max_len=16", "store.key_code=*x16", "budget=none"],
    )
    assert s.neighbours == 0 and s.budget is None
    assert s.store.segment.max_len == 16 and s.store.key_code == "*x16"
    assert MethodSettings().store == StoreSettings()  # the default is untouched
    assert "store.segment.max_len" in setting_names(MethodSettings())
    assert "warn" not in setting_names(MethodSettings())


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("bogus=1", "unknown setting 'bogus'"),
        ("neighbours", "is not KEY=VALUE"),
        ("neighbours=many", "expected int"),
        ("store=3", "a group of settings"),
        ("store.sketch_dim=7", "must be even"),
        ("store.segment.min_len=9", "min_len <= max_len"),
        ("store.key_code=16x8,48x4", "'16x8,48x4' is not a key code: use even:S"),
        ("store.key_code=*x4", "not a key code"),
        ("store.key_code=even:x", "the step must be a number"),
        ("store.value_code=8x8,24x4,32x2", "not a value code: use \\*x4 or \\*x16"),
        ("store.value_code=even:0.2", "not a value code"),
    ],
)
def test_override_refuses_what_a_user_must_fix(assignment, message):
    with pytest.raises(SekvError, match=message):
        override(MethodSettings(), [assignment])
