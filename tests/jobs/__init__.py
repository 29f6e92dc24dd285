"""The rank scripts the tests launch (``ranks.run(n, [TESTS / "jobs" / "train_parity.py", ...])``,
or torchrun): each runs on every rank of one job and writes what the test reads. A test may
import a script's helper (``from jobs.loader_dist import table_digest``) to compute the same
digest on its side.
"""
