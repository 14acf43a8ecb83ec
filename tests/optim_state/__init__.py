"""Tests of the torch optimizers (ckpttool.optim_state); those that need an accelerator skip without one."""
