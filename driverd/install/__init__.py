"""Changing the driver on a host: the kernel modules and the user-space installed crash-safe, the kept
store, the reboot gate."""
