"""Tests of the conformance kit (melix_fsm.testing)."""
