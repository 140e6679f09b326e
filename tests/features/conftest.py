"""Shared builders of small event rows (dicts of EVENTS_TABLE_SCHEMA fields) for build tests."""

from __future__ import annotations

from typing import Any

import pytest


def event(event_id: str, t_ms: int, event_type: str, *, user: str = "u1", item: str = "i1",
          domain: str = "d1", **extra: Any) -> dict[str, Any]:
    """One event row; optional fields default to None, created_ts_ms to t_ms + 1."""
    row = {
        "event_id": event_id, "event_time_ms": t_ms, "user_id": user, "item_id": item, "domain": domain,
        "event_type": event_type, "category": None, "position": None, "ad_format": None, "age": None,
        "gender": None, "location": None, "schema_version": 1, "created_ts_ms": t_ms + 1,
    }
    row.update(extra)
    return row


@pytest.fixture
def make_event():
    """The :func:`event` builder."""
    return event
