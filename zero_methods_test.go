package verbs_test

import (
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/zerocheck"
)

// TestZeroObjectMethodsDevices calls every exported method of the zero value of
// every object type (a var never made by its constructor, as a program
// may hold in a struct field) with zero arguments (internal/zerocheck):
// none may panic, and those that return an error return one
// (there is no object to act on), except those of noError. Before,
// QPN of a zero queue pair and Close of a zero CMConn panicked; with the
// hardware provider (-tags ibverbs, the VM tier: hence the name), so did
// the accessors of a zero CMRequest and CMConn.RemoteQPN.
func TestZeroObjectMethodsDevices(t *testing.T) {
	zerocheck.Methods(t, []any{
		&verbs.Context{}, &verbs.ProtectionDomain{}, &verbs.MemoryRegion{},
		&verbs.CompletionQueue{}, &verbs.CompletionChannel{},
		&verbs.RCQueuePair{}, &verbs.UCQueuePair{}, &verbs.UDQueuePair{},
		&verbs.SharedReceiveQueue{}, &verbs.AddressHandle{},
		&verbs.RCBatch{}, &verbs.UCBatch{}, &verbs.UDBatch{}, &verbs.RecvBatch{},
		&verbs.CMListener{}, &verbs.CMRequest{}, &verbs.CMConn{},
	}, noError)
}

// noError are the methods that may succeed on a zero value.
var noError = map[string]bool{
	// Close and its kin are idempotent: a zero object is as good as
	// closed.
	"Context.Close": true, "ProtectionDomain.Close": true, "MemoryRegion.Close": true,
	"CompletionQueue.Close": true, "CompletionChannel.Close": true,
	"RCQueuePair.Close": true, "UCQueuePair.Close": true, "UDQueuePair.Close": true,
	"SharedReceiveQueue.Close": true, "AddressHandle.Close": true,
	"CMListener.Close": true, "CMConn.Close": true, "CMConn.Disconnect": true,
	"CMRequest.Reject": true,
	// Arithmetic on the range the MR recorded (no call to the device):
	// the zero MR has 0 bytes, and an empty SGE at offset 0 fits.
	"MemoryRegion.SGE": true,
	// An empty batch posts nothing.
	"RecvBatch.Submit": true,
}
