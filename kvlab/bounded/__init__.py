"""Generation with a bounded cache: the cache is shrunk while the model reads and writes on.

- :mod:`kvlab.bounded.online`: Attention Matching's online compaction (and a
  sliding-window baseline), teacher-forced log-probabilities under a budget;
- :mod:`kvlab.bounded.beacon`: BeaconKV's budgeted greedy decoding.
"""
