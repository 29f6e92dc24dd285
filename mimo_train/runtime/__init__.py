"""Run-time plumbing: joining the job and its control group (``distributed``), the device
(``devices``), what training prints and how failures reach the user (``console``), and stops on
a signal (``preemption``). Imports nothing of mimo_train above ``errors``.
"""
