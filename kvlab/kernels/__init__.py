"""Triton kernels with torch references, behind one dispatch point.

Three kernels (see their modules for the maths and layouts):

* :func:`decode_attention`: a few new queries over a compacted cache (one
  float32 bias per key, ragged heads as -inf padding, then the recent
  tokens), GQA, split along the keys with a log-sum-exp merge (its Triton code,
  :mod:`kvlab.runtime.triton_decode`, and launch, :mod:`kvlab.runtime.kernel_launch`, are the
  runtime's: the model's forward pass launches it; this package sits above the runtime);
* :func:`mixed_attention`: KIVI-packed 2/4/8-bit keys and values
  (:class:`~kvlab.runtime.low_bit.PackedTensor`), dequantised in registers,
  followed by full-precision tokens;
* :func:`key_scores`: Attention Matching's RMS / mean / max key scores
  without the n-by-T attention matrix.

Each (in :mod:`kvlab.kernels.dispatch`) runs the Triton kernel on CUDA
tensors and the torch reference (:mod:`kvlab.kernels.reference`) elsewhere. ``KVLAB_KERNELS`` overrides the
choice: ``torch`` always uses the references, ``triton`` always uses the
kernels (on CPU tensors this needs ``TRITON_INTERPRET=1`` set before
triton is imported: that is how the tests run them), ``auto`` (the
default) decides by device. Triton is imported only when a kernel runs.
"""
