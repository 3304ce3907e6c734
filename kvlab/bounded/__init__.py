"""Generation with a bounded cache: the cache is shrunk while the model reads and writes on.

- :mod:`kvlab.bounded.loop`: the one loop every policy runs in (greedy or
  teacher-forced) and the policies' base classes;
- :mod:`kvlab.bounded.policy_registry`: every policy by name (register, look up, build, the docs' table);
- :mod:`kvlab.bounded.policies`: the policies, one file each, found by discovery (the unbounded
  reference, StreamingLLM, H2O, BeaconKV, online Attention Matching);
- :mod:`kvlab.bounded.beacon`: BeaconKV's budgeted decoding after a document;
- :mod:`kvlab.bounded.online`: Attention Matching's online compaction (and a
  sliding-window baseline), teacher-forced log-probabilities under a budget.

Its task with a known answer (copying a list of codes) is :mod:`kvlab.tasks.copying`.
"""
