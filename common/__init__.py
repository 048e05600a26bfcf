"""What the Ingress, the router and the engine share: sampling params and their checks, errors,
the messages between Ingress and replicas, prompt tokenization, block hashing, model sources.

Nothing here imports torch (tests/common/test_common.py checks): the Ingress and the router load this
package without the engine's weight."""
