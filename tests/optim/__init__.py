"""Tests of the torch optimizers (ckpttool.optim); those that need an accelerator skip without one."""
