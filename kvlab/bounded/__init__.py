"""Generation with a bounded cache: the cache is shrunk while the model reads and writes on.

- :mod:`kvlab.bounded.generate`: the one loop every policy runs in (greedy or
  teacher-forced), the unbounded reference, the sliding window (StreamingLLM) and H2O;
- :mod:`kvlab.bounded.beacon`: BeaconKV's budgeted decoding;
- :mod:`kvlab.bounded.online`: Attention Matching's online compaction (and a
  sliding-window baseline), teacher-forced log-probabilities under a budget;
- :mod:`kvlab.bounded.policies`: every policy by name.

Its task with a known answer (copying a list of codes) is :mod:`kvlab.tasks.copying`.
"""
