"""The compressed-cache runtime: cache data structures, the attention hook, the decode loop."""
