// Package netsrc groups the source addresses of connections for the
// limits a listener puts on strangers (connections that have not
// authenticated yet).
//
// An IPv4 address is usually one host. An IPv6 host is usually given a
// whole /64 network: 2^64 addresses to open connections from, so a limit
// per address does not bound it. Net64 names that network, which a
// listener counts too.
package netsrc
