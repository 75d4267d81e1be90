"""The daemon as an operator runs it: the command line (cli), settings from flags and a
config file (config), the daemon that wires every layer together (daemon), the fstab
helper (mounthelper), checks before mounting (preflight) and systemd's readiness
protocol (sdnotify).

May import: every other package.
"""
