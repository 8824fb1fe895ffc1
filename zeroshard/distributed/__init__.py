"""Processes and their collectives: the process group from the launcher's environment
(``process_group``), the device mesh and its groups (``mesh``), the one door to
``torch.distributed`` collectives (``comm``) and the ledger that counts them
(``ledger``), the watchdog that turns hangs into reports (``watchdog``), the device
seam (``device``; ``fake_device`` for CPU tests) and the environment variables read
across layers (``env``).
"""
