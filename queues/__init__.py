"""What crosses process boundaries: the typed messages and the bounded Ray queues."""
