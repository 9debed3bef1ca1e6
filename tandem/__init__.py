"""tandem: EAGLE-3 speculative decoding with the draft as its own service."""

import os

# gRPC's fork support (on by default) re-arms its poller in every child forked by a
# process that has used gRPC; a Popen child with a preexec_fn (a real fork, not vfork)
# then aborts before exec about 1-2% of the time with "epoll_wait error: Bad file
# descriptor" (grpc/grpc#43055). tandem never uses gRPC in a forked child: its children
# exec and its TP workers are spawned. Set before any grpc import through this package.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
