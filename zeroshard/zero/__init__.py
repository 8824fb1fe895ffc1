"""ZeRO: which model states are sharded across data-parallel ranks, and how."""
