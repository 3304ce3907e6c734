"""The selection wrappers' maths (AdaKV, ChunkKV, CriticalKV), one module each; kvlab.compression.selection applies them."""
