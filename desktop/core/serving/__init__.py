"""The stable endpoint: HTTP/1 transport, upstream pool, routing and drain, OpenAI metering, control channel."""
