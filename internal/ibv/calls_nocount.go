//go:build ibverbs && linux && cgo && !ibv_count

package ibv

// CountingCalls reports whether this build counts the data-path C calls
// (build tag ibv_count).
const CountingCalls = false

// countCall compiles to nothing without the build tag ibv_count.
func countCall(callKind) {}

// DataPathCalls returns zeros: counting needs the build tag ibv_count.
func DataPathCalls() Calls { return Calls{} }
