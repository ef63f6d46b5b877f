/// Server confirmation that the transaction has been committed.
