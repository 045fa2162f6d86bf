// Package testproc runs the test binary again as a child process of a
// test: for tests that need a process of their own (its resource limits,
// its memory as the kernel counts it, its death), and for peers in
// another process.
//
// The child is the same binary, started with -test.run=^$ and the
// environment the test gives (its TestMain looks for it and runs the
// child's program instead of the tests), with the race detector's exit
// wait turned off. Parent and child talk in lines: the parent writes
// commands to the child's stdin (Send), the child answers on stdout, a
// line starting with a word (Line); its stderr is kept (Stderr). A Proc
// is killed when its test ends unless Stop ended it cleanly first.
//
// A Proc is for the goroutine of its test.
package testproc
