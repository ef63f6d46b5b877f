/// Server confirmation that unacknowledged messages have been requeued.
