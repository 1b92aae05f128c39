"""One ``/metrics`` scrape against the scheduler thread finishing a request mid-scrape."""

from kern.metrics import Metrics

RUNNING = "kern_num_requests_running"
ABORTS = "kern_request_success"


def _scrape_with_a_finish_after(k: int) -> dict[str, float]:
    """Scrape a server with one request running; after the scrape's ``k``-th family the
    scheduler ends it as its thread does (counts the finish, then snapshots the gauges)."""
    m = Metrics("kern")
    m.gauges = {**m.gauges, RUNNING: 1}
    seen: dict[str, float] = {}
    for n, family in enumerate(m.registry.collect()):
        for s in family.samples:
            if s.labels.get("finished_reason", "abort") == "abort":
                seen[s.name] = s.value
        if n == k:
            m.success["abort"].inc()
            m.gauges = {**m.gauges, RUNNING: 0}
    return seen


def test_a_scrape_that_shows_idle_counts_what_finished():
    """Wherever the finish lands in a scrape, gauges that show nothing running come with the
    finish counted (a client waiting for idle then reads the counters it waits for)."""
    families = sum(1 for _ in Metrics("kern").registry.collect())
    for k in range(families):
        seen = _scrape_with_a_finish_after(k)
        if seen[RUNNING] == 0:
            assert seen[ABORTS + "_total"] == 1, f"idle gauges with the abort uncounted ({k=})"
