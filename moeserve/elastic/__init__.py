"""Elastic expert parallelism: a dp x ep deployment that loses a rank keeps serving on the
others and, with `parallel.elastic_relaunch`, takes a relaunched rank back
(docs/elastic_ep.md).

Who does what:
- membership.py: the membership generations (which ranks form the group), heartbeats and
  failure reports, kept in a TCPStore that the launcher hosts (it outlives any rank);
- supervisor.py (launcher process): sees a rank die or go silent, publishes the next
  membership, tells the DP controller to route around it, relaunches it;
- rank.py (each scheduler process): turns a failed collective into a recovery: requeue the
  rank's requests, leave the broken groups, join the new ones, re-place the experts;
- group.py: process groups of one generation (gloo with bounded timeouts);
- placement.py: which expert goes where on the survivors (DeepSeek's EPLB) and where each copy
  comes from; weights.py moves them (peer copies, else the checkpoint);
- requeue.py: a rank's requests back to its queue after a failed step;
- retry.py (tokenizer manager): requests of a dead rank resumed elsewhere, or failed clearly;
- metrics.py: ranks alive, recoveries, recovery seconds, requests retried and failed.
"""
