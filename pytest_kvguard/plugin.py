"""The pytest plugin (entry point ``pytest11: kvguard``); dormant unless switched on."""
