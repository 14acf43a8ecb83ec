"""Tests that need an accelerator (cuda/npu); each module skips cleanly without one."""
