package provproxy

// Outstanding returns how many calls of c wait for their response.
func Outstanding(c *Client) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.pending)
}
