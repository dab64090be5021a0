"""Process start-up, below both faces (the HTTP server and the offline Engine): children that die
with their launcher and stop on its signal (children.py), a node's scheduler ranks (ranks.py),
where the processes meet (rendezvous.py: ports, the torch.distributed address; slurm.py: a Slurm
job's nodes), the ipc:// socket files (ipc_files.py), taking the tree down (supervise.py), and
a finished process' exit without the interpreter's teardown (exit.py).

It starts whatever role functions its caller hands it, so it imports no scheduler and no server.
"""
