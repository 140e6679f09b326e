"""Synthetic ads traffic for three GEM domains, deterministic by seed.

Real samples cannot cover scale or rare failure modes; this generator can. Model (all choices are
ours, stated so a reader can judge the numbers):

- Users and ads have power-law (Zipf) popularity: user u's activity weight is ``(u+1)^-a_user``,
  ad j's is ``(j+1)^-a_ad``. Each user has a home mix over the domains facebook, instagram,
  messaging (Dirichlet), an age bucket, a gender and a location drawn once.
- Sessions: a Poisson number per user over the period, proportional to the activity weight;
  each session sits in one domain, starts uniformly in the period and shows a geometric number of
  ads spaced by exponential gaps (mean ``ad_gap_s``), plus organic ``engagement`` events.
- Labels: click probability = domain base CTR x ad quality (log-normal) x user affinity
  (log-normal), clipped to [0, 0.5]; click latency log-normal with median ``click_delay_median_s``
  (seconds to minutes). A clicked impression converts with the domain's CVR after a log-normal
  delay with median ``conversion_delay_median_s`` (hours to days). Labels are separate, later events
  of the same user, ad and domain, as an attribution join expects.
- Bad records at ``bad_rate``: not JSON, a missing required field, an unknown domain, a wrong
  type, an event time far in the future. They are RawRecords, for the ingest job to dead-letter.

Everything is drawn from one ``numpy.random.Generator(PCG64(seed))``: the same config gives the
same records, byte for byte.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np

from gemline.errors import BadConfigError
from ingest.datasets.types import RawRecord, Record
from ingest.schema import Event

GEM_DOMAINS: tuple[str, ...] = ("facebook", "instagram", "messaging")
BAD_KINDS: tuple[str, ...] = ("not_json", "missing_field", "unknown_domain", "wrong_type", "future_event_time")
_MS_PER_DAY = 86_400_000


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """Size and rates of the synthetic traffic."""

    num_users: int = 1_000
    """Distinct users."""
    num_ads: int = 500
    """Distinct ads."""
    days: float = 3.0
    """Length of the period, days."""
    start_ms: int = 1_767_225_600_000
    """Start of the period, ms since epoch UTC (default 2026-01-01T00:00Z)."""
    sessions_per_user_per_day: float = 2.0
    """Mean sessions of an average user per day."""
    ads_per_session: float = 5.0
    """Mean ads shown per session (geometric)."""
    engagements_per_session: float = 3.0
    """Mean organic engagement events per session (Poisson)."""
    ad_gap_s: float = 20.0
    """Mean gap between consecutive events of a session, seconds."""
    user_zipf: float = 1.1
    """Zipf exponent of user activity."""
    ad_zipf: float = 1.05
    """Zipf exponent of ad popularity."""
    ctr: tuple[float, ...] = (0.015, 0.012, 0.03)
    """Base click-through rate per domain, in GEM_DOMAINS order."""
    cvr: tuple[float, ...] = (0.08, 0.06, 0.12)
    """Conversion rate of a click per domain, in GEM_DOMAINS order."""
    click_delay_median_s: float = 30.0
    """Median delay from impression to click, seconds."""
    conversion_delay_median_s: float = 6 * 3600.0
    """Median delay from click to conversion, seconds (log-normal, tails into days)."""
    bad_rate: float = 0.0
    """Fraction of extra records that are malformed, relative to the good ones."""
    seed: int = 0
    """Seed of every draw."""
    wall_clock: bool = False
    """A live stream: ``gemline generate --rate R`` stamps each event with the wall-clock time (ms since epoch UTC)
    of the one-second slice that produces it, instead of its time in the generated period (which starts at
    ``start_ms``, in the past). The order is kept; a click or conversion then follows its impression by the
    stream's gap between them (period time compressed to the rate), not by the drawn delay. Freshness is
    measured against these times (benchmarks.freshness)."""

    def __post_init__(self) -> None:
        for name in ("num_users", "num_ads"):
            if getattr(self, name) < 1:
                raise BadConfigError(f"generate.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("days", "sessions_per_user_per_day", "ads_per_session", "ad_gap_s",
                     "click_delay_median_s", "conversion_delay_median_s"):
            if getattr(self, name) <= 0:
                raise BadConfigError(f"generate.{name} must be > 0, got {getattr(self, name)}")
        if self.engagements_per_session < 0:
            raise BadConfigError(f"generate.engagements_per_session must be >= 0, got {self.engagements_per_session}")
        if len(self.ctr) != len(GEM_DOMAINS) or len(self.cvr) != len(GEM_DOMAINS):
            raise BadConfigError(f"generate.ctr and generate.cvr need one rate per domain {GEM_DOMAINS}")
        if not all(0 <= r <= 1 for r in (*self.ctr, *self.cvr)):
            raise BadConfigError("generate.ctr and generate.cvr must lie in [0, 1]")
        if not 0 <= self.bad_rate <= 1:
            raise BadConfigError(f"generate.bad_rate must be in [0, 1], got {self.bad_rate}")


@dataclass(frozen=True)
class _Population:
    activity: np.ndarray  # (U,) float64, sums to 1
    domain_mix: np.ndarray  # (U, 3) float64, rows sum to 1
    affinity: np.ndarray  # (U,) float64
    age: np.ndarray  # (U,) int64
    gender: np.ndarray  # (U,) <U1
    location: np.ndarray  # (U,) int64
    ad_weight: np.ndarray  # (A,) float64, sums to 1
    ad_quality: np.ndarray  # (A,) float64
    ad_category: np.ndarray  # (A,) int64
    ad_format: np.ndarray  # (A,) <U8


def _population(cfg: GenerateConfig, rng: np.random.Generator) -> _Population:
    activity = (np.arange(cfg.num_users) + 1.0) ** -cfg.user_zipf
    ad_weight = (np.arange(cfg.num_ads) + 1.0) ** -cfg.ad_zipf
    return _Population(
        activity=activity / activity.sum(),
        domain_mix=rng.dirichlet([2.0, 2.0, 1.0], size=cfg.num_users),
        affinity=rng.lognormal(0.0, 0.5, size=cfg.num_users),
        age=rng.choice([18, 25, 35, 45, 55, 65], size=cfg.num_users),
        gender=rng.choice(np.array(["f", "m", "u"]), size=cfg.num_users, p=[0.48, 0.48, 0.04]),
        location=rng.integers(0, 50, size=cfg.num_users),
        ad_weight=ad_weight / ad_weight.sum(),
        ad_quality=rng.lognormal(0.0, 0.6, size=cfg.num_ads),
        ad_category=rng.integers(0, 40, size=cfg.num_ads),
        ad_format=rng.choice(np.array(["image", "video", "carousel"]), size=cfg.num_ads),
    )


def _event(pop: _Population, cfg: GenerateConfig, n: int, t_ms: int, u: int, ad: int, dom: int, etype: str,
           position: int | None) -> Event:
    return Event(
        event_id=f"syn{cfg.seed}:{n}", event_time_ms=int(t_ms), user_id=f"u{u}", item_id=f"ad{ad}",
        domain=GEM_DOMAINS[dom], event_type=etype, category=f"c{pop.ad_category[ad]}", position=position,
        ad_format=str(pop.ad_format[ad]), age=int(pop.age[u]), gender=str(pop.gender[u]),
        location=f"l{pop.location[u]}",
    )


def _bad_record(kind: str, good: Event, cfg: GenerateConfig, n: int) -> RawRecord:
    body = json.loads(good.to_json())
    body["event_id"] = f"syn{cfg.seed}:bad{n}"
    if kind == "not_json":
        return RawRecord(value=b"{not json" + str(n).encode(), key=good.key, reason_hint=kind)
    if kind == "missing_field":
        del body["user_id"]
    elif kind == "unknown_domain":
        body["domain"] = "myspace"
    elif kind == "wrong_type":
        body["event_time_ms"] = str(body["event_time_ms"])
    elif kind == "future_event_time":
        body["event_time_ms"] = 4_102_444_800_000  # 2100-01-01: beyond any allowed skew
    return RawRecord(value=json.dumps(body, separators=(",", ":")).encode(), key=good.key, reason_hint=kind)


def generate_records(cfg: GenerateConfig) -> list[Record]:
    """All records of the configured period, sorted by event time (bad records interleaved by position).

    Returns:
        Events (impression, click, conversion, engagement) and RawRecords (malformed), the
        Events in non-decreasing ``event_time_ms``; ``event_id`` is ``syn<seed>:<n>``.
    """
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    pop = _population(cfg, rng)
    period_ms = int(cfg.days * _MS_PER_DAY)
    # Sessions, vectorized: one row per session.
    per_user = rng.poisson(pop.activity * cfg.num_users * cfg.sessions_per_user_per_day * cfg.days)
    s_user = np.repeat(np.arange(cfg.num_users), per_user)
    num_sessions = len(s_user)
    s_domain = (rng.random(num_sessions)[:, None] > np.cumsum(pop.domain_mix[s_user], axis=1)).sum(axis=1)
    s_domain = np.minimum(s_domain, 2)
    s_start = cfg.start_ms + rng.integers(0, period_ms, size=num_sessions)
    s_ads = rng.geometric(1.0 / cfg.ads_per_session, size=num_sessions)
    s_organic = rng.poisson(cfg.engagements_per_session, size=num_sessions)
    # Events of sessions: one row per shown ad or organic event, shuffled within each session.
    s_len = s_ads + s_organic
    e_session = np.repeat(np.arange(num_sessions), s_len)
    rank_in_session = np.arange(len(e_session)) - np.repeat(np.cumsum(s_len) - s_len, s_len)
    e_is_ad = rank_in_session < np.repeat(s_ads, s_len)
    order = np.lexsort((rng.random(len(e_session)), e_session))
    e_session, e_is_ad = e_session[order], e_is_ad[order]
    gaps = (rng.exponential(cfg.ad_gap_s, size=len(e_session)) * 1000).astype(np.int64) + 1
    cum = np.cumsum(gaps)
    first = np.cumsum(s_len) - s_len
    e_time = s_start[e_session] + cum - np.repeat(cum[first] - gaps[first], s_len)
    e_user = s_user[e_session]
    e_domain = s_domain[e_session]
    e_ad = rng.choice(cfg.num_ads, size=len(e_session), p=pop.ad_weight)
    ads_before = np.cumsum(e_is_ad) - np.repeat(np.cumsum(e_is_ad)[first] - e_is_ad[first], s_len)
    p_click = np.minimum(0.5, np.asarray(cfg.ctr)[e_domain] * pop.ad_quality[e_ad] * pop.affinity[e_user])
    clicked = e_is_ad & (rng.random(len(e_session)) < p_click)
    click_delay = (rng.lognormal(np.log(cfg.click_delay_median_s), 1.0, size=len(e_session)) * 1000).astype(np.int64) + 1
    converted = clicked & (rng.random(len(e_session)) < np.asarray(cfg.cvr)[e_domain])
    conv_delay = (rng.lognormal(np.log(cfg.conversion_delay_median_s), 1.2, size=len(e_session)) * 1000).astype(np.int64) + 1

    events: list[Event] = []
    n = 0
    for i in range(len(e_session)):
        u, ad, dom, t = int(e_user[i]), int(e_ad[i]), int(e_domain[i]), int(e_time[i])
        if not e_is_ad[i]:
            events.append(_event(pop, cfg, n, t, u, ad, dom, "engagement", None))
            n += 1
            continue
        position = int(ads_before[i])
        events.append(_event(pop, cfg, n, t, u, ad, dom, "impression", position))
        n += 1
        if clicked[i]:
            t_click = t + int(click_delay[i])
            events.append(_event(pop, cfg, n, t_click, u, ad, dom, "click", position))
            n += 1
            if converted[i]:
                events.append(_event(pop, cfg, n, t_click + int(conv_delay[i]), u, ad, dom, "conversion", position))
                n += 1
    events.sort(key=lambda e: (e.event_time_ms, e.event_id))
    num_bad = int(round(cfg.bad_rate * len(events)))
    if not num_bad or not events:
        return list(events)
    slots = np.sort(rng.integers(0, len(events), size=num_bad))
    kinds = rng.choice(len(BAD_KINDS), size=num_bad)
    records: list[Record] = []
    prev = 0
    for i, (slot, kind) in enumerate(zip(slots.tolist(), kinds.tolist())):
        records.extend(events[prev:slot])
        records.append(_bad_record(BAD_KINDS[kind], events[slot], cfg, i))  # just before the event it copies
        prev = slot
    records.extend(events[prev:])
    return records


def in_time_order(records: list[Record]) -> list[Record]:
    """``records`` with the Events in event-time order (stable) and each RawRecord (a bad message)
    kept right after the Event it followed, so bad messages stay spread through the stream
    (``event_time_sort_key`` would put them all last, at the end of every partition)."""
    keys: list[int] = []
    last = -(2**63)
    for rec in records:
        if isinstance(rec, Event):
            last = rec.event_time_ms
        keys.append(last)
    return [records[i] for i in sorted(range(len(records)), key=keys.__getitem__)]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def stamped(records: list[Record], now_ms: int) -> list[Record]:
    """``records`` with every Event's ``event_time_ms`` set to ``now_ms`` (ms since epoch UTC); malformed
    records (RawRecord) unchanged."""
    return [r.at(now_ms) if isinstance(r, Event) else r for r in records]


def stream_records(records: list[Record], *, bootstrap: str, topic: str, partitions: int,
                   rate_per_s: float | None = None, batch_messages: int = 1, progress: bool = True,
                   wall_clock: bool = False, stop: threading.Event | None = None) -> int:
    """Produce ``records`` to Kafka, at most ``rate_per_s`` events/s (as fast as possible if None).

    Paces in one-second slices: each slice of ``rate_per_s`` records is produced and acknowledged
    (``ingest.replay.replay``), then the rest of the second is slept. Returns the records produced.
    ``wall_clock``: each slice's events are stamped with the slice's start (:func:`stamped`;
    ``GenerateConfig.wall_clock``). ``stop``: set to stop (``ingest.replay.replay``'s ``stop``), also between slices.

    Raises:
        ValueError: ``rate_per_s`` <= 0.
        ingest.replay.DeliveryError: a message was not acknowledged.
        ingest.replay.ReplayInterrupted: Ctrl-C (a KeyboardInterrupt), with the count the broker acknowledged.
    """
    from ingest.replay import ReplayInterrupted, replay

    if rate_per_s is not None and rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    ordered = in_time_order(records)
    step = len(ordered) if rate_per_s is None else max(1, int(rate_per_s))
    produced = 0
    try:
        for start in range(0, len(ordered), step):
            began = time.monotonic()
            chunk = ordered[start:start + step]
            if wall_clock:
                chunk = stamped(chunk, _now_ms())
            replay(chunk, bootstrap=bootstrap, topic=topic, partitions=partitions,
                   batch_messages=batch_messages, progress=progress and rate_per_s is None, stop=stop)
            produced += len(chunk)
            if rate_per_s is not None and start + step < len(ordered):
                pause_s = max(0.0, 1.0 - (time.monotonic() - began))
                if stop is None:
                    time.sleep(pause_s)
                elif stop.wait(pause_s):
                    raise KeyboardInterrupt("stop set between slices")  # counted below, as a Ctrl-C there
    except ReplayInterrupted as exc:  # inside a slice: the slices before it were acknowledged whole
        raise ReplayInterrupted(produced + exc.acknowledged, exc.unacknowledged) from None
    except KeyboardInterrupt:  # between slices
        raise ReplayInterrupted(produced, 0) from None
    return produced
