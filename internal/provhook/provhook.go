// Package provhook lets the module's own test helpers turn provider objects
// into the public verbs types without widening the public API.
//
// Package verbs sets the hooks in an init function, so they are set in
// every program that links verbs, before main or any test runs, and never
// change afterwards: reading them needs no synchronization.
package provhook

import "github.com/goverbs/verbs/internal/prov"

// NewContext makes a *verbs.Context (returned as any, since this package
// cannot import verbs) from pc, an open context of the device dev of the
// provider named providerName. On success the returned Context owns pc:
// closing the Context closes pc. On error pc is left open for the caller to
// close. It is nil in programs that do not link package verbs.
var NewContext func(pc prov.Context, dev prov.DeviceInfo, providerName string) (any, error)
