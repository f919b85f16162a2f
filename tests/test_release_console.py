"""The console's Release column: a version's release state, the canary's share and the latest
verdict's reason (operator over canary over gate), none for a version off the release path."""

from __future__ import annotations

from clora_feedback.gateway.console.views import _release_fields
from clora_feedback.store.registry.releases import ReleaseRecord


def test_release_fields_name_the_state_share_and_latest_reason() -> None:
    assert _release_fields(None) == {"release": None, "release_share": None, "release_reason": None}
    canary = ReleaseRecord(
        "a", 3, "canary", 0.25, 2, {"gate": {"reason": "passed"}, "canary": {"reason": ""}}, 1.0
    )
    assert _release_fields(canary) == {
        "release": "canary", "release_share": 0.25, "release_reason": "passed",
    }  # fmt: skip
    aborted = ReleaseRecord(
        "a", 3, "aborted", 0.25, 2,
        {"gate": {"reason": "passed"}, "canary": {"reason": "worse live"},
         "operator": {"reason": "stop it"}}, 2.0,
    )  # fmt: skip
    assert _release_fields(aborted)["release_reason"] == "stop it"
