//! Growing a disk while a VMM is connected: through the frontend's admin channel (what
//! blkplaned's ResizeDisk uses), the image file grows, the VMM gets CONFIG_CHANGE_MSG on the
//! back-end request channel, the config space shows the new capacity, and the iothread
//! serves the new sectors. Shrinking is refused.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use blkplane_proto::v1::{
    frontend_request, frontend_response, FrontendRequest, FrontendResponse, ResizeRequest,
    StatusRequest,
};
use blkplane_tests::raw::RawDevice;
use blkplane_tests::*;
use prost::Message;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;

const MIB: u64 = 1 << 20;

fn admin_call(
    socket: &std::path::Path,
    request: frontend_request::Request,
) -> frontend_response::Response {
    let mut stream = UnixStream::connect(socket).expect("admin socket");
    let body = FrontendRequest {
        request: Some(request),
    }
    .encode_to_vec();
    stream
        .write_all(&(body.len() as u32).to_le_bytes())
        .unwrap();
    stream.write_all(&body).unwrap();
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).unwrap();
    let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut reply).unwrap();
    FrontendResponse::decode(reply.as_slice())
        .unwrap()
        .response
        .expect("empty response")
}

#[test]
fn grow_while_connected_notifies_the_vmm() {
    let dir = TempDir::new("resize");
    let img = create_image(&dir.join("disk.img"), 8 * MIB);
    let admin = dir.join("admin.sock");
    let admin_arg = admin.to_str().unwrap().to_owned();
    let fe = Frontend::start(&img, &["--admin-socket", &admin_arg]);
    let mut dev = RawDevice::connect_with(fe.socket(), 1, 64, true)
        .unwrap_or_else(|e| panic!("raw connect: {e}"));
    let channel = dev
        .backend_channel
        .take()
        .expect("the device offers BACKEND_REQ");
    assert_eq!(dev.config().capacity, 8 * MIB / 512);

    match admin_call(&admin, frontend_request::Request::Status(StatusRequest {})) {
        frontend_response::Response::Status(s) => {
            assert!(s.vmm_connected, "admin reports the VMM connection");
            assert_eq!(s.capacity_bytes, 8 * MIB);
        }
        other => panic!("status: {other:?}"),
    }
    match admin_call(
        &admin,
        frontend_request::Request::Resize(ResizeRequest {
            new_size_bytes: 4 * MIB,
        }),
    ) {
        frontend_response::Response::Error(e) => assert!(e.contains("shrinking"), "{e}"),
        other => panic!("shrink was not refused: {other:?}"),
    }
    match admin_call(
        &admin,
        frontend_request::Request::Resize(ResizeRequest {
            new_size_bytes: 16 * MIB,
        }),
    ) {
        frontend_response::Response::Resized(done) => {
            assert_eq!(done.capacity_bytes, 16 * MIB);
            assert!(done.guest_notified, "CONFIG_CHANGE_MSG was not sent");
        }
        other => panic!("resize: {other:?}"),
    }
    // The VMM side of the back-end channel receives CONFIG_CHANGE_MSG (code 2), no body.
    let mut channel = channel;
    channel
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut header = [0u8; 12];
    channel
        .read_exact(&mut header)
        .expect("CONFIG_CHANGE_MSG on the back-end channel");
    let code = u32::from_le_bytes(header[..4].try_into().unwrap());
    let size = u32::from_le_bytes(header[8..].try_into().unwrap());
    assert_eq!(
        code,
        u32::from(vhost::vhost_user::message::BackendReq::CONFIG_CHANGE_MSG)
    );
    assert_eq!(size, 0);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 16 * MIB);
    assert_eq!(dev.config().capacity, 16 * MIB / 512);
    // The new sectors are served by the iothread (it re-measures the grown image).
    let last = 16 * MIB / 512 - 8;
    let r = dev.read(0, last, 4096);
    assert_eq!(
        r.status_u32(),
        Some(VIRTIO_BLK_S_OK),
        "read of a new sector: {r:?}"
    );
    drop(dev);
    println!("resize 8 → 16 MiB while connected: file grown, CONFIG_CHANGE_MSG received, config capacity updated, new sectors readable; shrink refused");
    fe.finish();
}
