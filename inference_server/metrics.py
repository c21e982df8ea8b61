"""Prometheus text for one engine, read from its counters at scrape time (no module globals)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e, s = self.engine, self.engine.stats
        running, waiting = e.counts()
        for name, doc, value in (
            ("riptide_prompt_tokens", "Prompt tokens prefilled", s.prompt_tokens),
            ("riptide_shared_prompt_tokens", "Prompt tokens copied from a running request's KV cache instead",
             s.shared_prompt_tokens),
            ("riptide_generation_tokens", "Tokens generated", s.generation_tokens),
            ("riptide_requests_finished", "Sequences finished, aborts included", s.finished_requests),
            ("riptide_requests_aborted", "Sequences aborted", s.aborted_requests),
            ("riptide_engine_steps", "Engine steps run", s.steps),
            ("riptide_engine_busy_seconds", "Seconds spent inside engine steps", s.busy_seconds),
            ("riptide_weight_updates", "Weight versions swapped in", s.weight_updates),
            ("riptide_preemptions", "Sequences preempted when KV blocks ran out (re-prefilled later)",
             e.scheduler.preemptions),
            ("riptide_spec_draft_tokens", "Tokens drafted for speculative decoding", s.spec_drafted),
            ("riptide_spec_accepted_tokens", "Drafted tokens the policy accepted", s.spec_accepted),
            ("riptide_spec_steps", "Engine steps that verified drafts", s.spec_steps),
            ("riptide_row_forwards", "Sequence-steps: tokens generated over this is tokens a forward", s.row_forwards),
            *((f"riptide_kv_tier_{k}", f"Host KV tier: {k.replace('_', ' ')}", v)
              for k, v in e.tier_stats().items() if k != "host_entries"),
            ("riptide_episodes_ended", "Multi-turn episodes said over (/end_episode)", s.episodes_ended),
            ("riptide_ended_blocks", "Cached KV blocks of ended episodes put first in line for eviction", s.ended_blocks),
            ("riptide_cached_prompt_tokens", "Prompt positions taken from the prefix cache (paged), not computed",
             e.scheduler.cached_tokens),
            *_cpu_ways(e),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("riptide_num_running_reqs", "Sequences holding a KV slot", running),
            ("riptide_num_queue_reqs", "Sequences waiting for a slot", waiting),
            ("riptide_weight_version", "Weight version being served", e.version),
            ("riptide_last_swap_stall_seconds", "Serving stall of the last weight swap", s.last_swap_stall_s),
            ("riptide_peak_running_reqs", "Most sequences run in one step", s.peak_running),
            *e.kv_gauges(),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


def _cpu_ways(engine):
    """A CPU server's steps by how they ran (cpu_split.TwoWays): on its own threads or on a team over
    every core, and the times a neighbour was seen stalling the team."""
    ways = [w for w in (getattr(engine.runner, "ways", None), getattr(engine.runner, "verify_ways", None)) if w]
    if not ways:
        return ()
    return (("riptide_cpu_team_steps", "CPU steps run on an OpenMP team over every core", sum(w.taken["team"] for w in ways)),
            ("riptide_cpu_own_steps", "CPU steps run on the engine's own thread(s)", sum(w.taken["own"] for w in ways)),
            ("riptide_cpu_team_stalls", "Times a team step stalled behind a busy neighbour (every step size left the team)",
             sum(w.stalls for w in ways)))


def metrics_text(engine) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))
    return generate_latest(registry)
