"""What every room uses: user-facing errors, where files live, progress events and the SSE decoder."""
