"""prime-swarm wire protocol: messages, codec, identity and signed envelopes.

Owns everything two processes must agree on to talk to each other. Invariant: this
package never imports torch (the scheduler installs and starts without it).
"""

PROTOCOL_VERSION = 1
