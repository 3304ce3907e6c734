"""Checks kvlab runs on itself: the CPU stand-in for CUDA and the device suite that uses it."""
