"""The security suite: authentication, tenant isolation at the edges, input limits, rate limits, and a schema fuzzer."""
