"""What runs on Ray: rank actors, gang launch and teardown, the benchmark protocol, the search.

Knows nothing of the database: its public functions take a run config and return results or
raise typed errors. The scheduler (service/) uses:
- workers.cluster: connect(address), describe(), check_feasible(config) -> raises Infeasible
- workers.gang: GangPool().start(config, kind, on_waiting=...) -> RunHandle (poll, kill,
  placement); GangPool.close()
- workers.results: RunOutcome (RankResult, ProbeResult, EnvironmentInfo; `row()` per table)
- workers.errors: GangError, Infeasible, RankFailed, PlacementTimeout
"""
