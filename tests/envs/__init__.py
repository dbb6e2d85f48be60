"""Environments written as outsiders write them (no project code), for tests that show a
verifiers environment runs through the pool unchanged."""
