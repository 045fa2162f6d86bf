// Package zerocheck tests what the exported methods of a package's types
// do on their zero values (a var never made by its constructor, as a
// program may hold in a struct field): none may panic, and each that
// returns an error returns one, as there is no object to act on. It is
// for the project's tests only.
package zerocheck

import (
	"context"
	"reflect"
	"testing"
	"time"
)

// Methods calls every exported method of every object in objs (pointers
// to zero values) with zero arguments, but for slices of one zero element,
// a cancelled context (so that no call can block) and one nanosecond for
// durations. A method that panics fails the test; so does one whose error
// result is nil, unless its "Type.Method" is in noError (Close and its
// kin, which succeed on what is as good as closed; accessors of recorded
// values).
func Methods(t *testing.T, objs []any, noError map[string]bool) {
	t.Helper()
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	ctxType := reflect.TypeFor[context.Context]()
	errType := reflect.TypeFor[error]()
	durType := reflect.TypeFor[time.Duration]()
	for _, obj := range objs {
		v := reflect.ValueOf(obj)
		typ := v.Type()
		for i := range typ.NumMethod() {
			m := typ.Method(i)
			name := typ.Elem().Name() + "." + m.Name
			t.Run(name, func(t *testing.T) {
				mt := m.Type // the receiver first
				args := []reflect.Value{v}
				for j := 1; j < mt.NumIn(); j++ {
					in := mt.In(j)
					a := reflect.Zero(in)
					switch {
					case in == ctxType:
						a = reflect.ValueOf(cancelled)
					case in == durType:
						a = reflect.ValueOf(time.Nanosecond)
					case in.Kind() == reflect.Slice:
						a = reflect.MakeSlice(in, 1, 1)
					}
					args = append(args, a)
				}
				done := make(chan []reflect.Value, 1)
				panicked := make(chan any, 1)
				go func() {
					defer func() {
						if p := recover(); p != nil {
							panicked <- p
						}
					}()
					if mt.IsVariadic() {
						done <- m.Func.CallSlice(args)
					} else {
						done <- m.Func.Call(args)
					}
				}()
				var out []reflect.Value
				select {
				case out = <-done:
				case p := <-panicked:
					t.Fatalf("panic: %v", p)
				case <-time.After(time.Minute):
					t.Fatal("hang guard: no return in a minute, with a cancelled context")
				}
				for j, o := range out {
					if mt.Out(j) != errType || noError[name] {
						continue
					}
					if o.IsNil() {
						t.Errorf("returned no error")
					} else {
						t.Log(o.Interface())
					}
				}
			})
		}
	}
}
