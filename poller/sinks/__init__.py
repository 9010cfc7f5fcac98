"""Where a tick's batches go: a Service Bus queue or topic, or a Storage queue."""
