package soft

import (
	"os"
	"sync"
)

// override is a setting that an environment variable gives and that tests
// may force (ForceTransport, ForceTLS) until they restore the previous
// value. Safe for concurrent use.
type override struct {
	env   string
	parse func(string) (string, error) // "" (unset) is valid

	mu  sync.Mutex
	v   string
	set bool
}

// force makes v (parsed) the setting, taking precedence over the
// environment, until restore.
func (o *override) force(v string) (restore func(), err error) {
	p, err := o.parse(v)
	if err != nil {
		return nil, err
	}
	o.mu.Lock()
	prev, prevSet := o.v, o.set
	o.v, o.set = p, true
	o.mu.Unlock()
	return func() {
		o.mu.Lock()
		o.v, o.set = prev, prevSet
		o.mu.Unlock()
	}, nil
}

// get returns the forced value, or else the environment's, parsed.
func (o *override) get() (string, error) {
	o.mu.Lock()
	v, set := o.v, o.set
	o.mu.Unlock()
	if set {
		return v, nil
	}
	return o.parse(os.Getenv(o.env))
}
