/// Server confirmation of a `queue.declare`, returning the queue name, message count, and consumer count.
