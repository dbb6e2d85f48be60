"""The trusted side: orchestrator and FSDP2 trainer (built in the trainer issue)."""
