//! The commands' tests: their JSON, signed bytes and outcomes as the code before the typed
//! commands produced them (captured), what each reads as, the signature and the guard.
use super::*;
use crate::registry::control::{REFUSED_BAD_SIGNATURE, REFUSED_UNSIGNED};
use crate::registry::control::{Refusal, Rejected};
use crate::registry::guard::Guard;
use crate::registry::outcome::{CtlOutcome, Recorder};

#[test]
fn a_concurrency_command_carries_its_bounds_signed_and_in_its_outcome() {
    let c = CtlCommand::new(
        "x".into(),
        Command::Concurrency {
            min: Some(2),
            max: None,
        },
        Some("orders".into()),
        1,
        "h:1".into(),
    );
    let json = serde_json::to_string(&c).unwrap();
    assert!(json.contains(r#""command":"concurrency""#) && json.contains(r#""min":2"#));
    assert!(!json.contains("max"), "{json}");
    let back: CtlCommand = serde_json::from_str(&json).unwrap();
    assert_eq!(back, c);
    let canonical = String::from_utf8(c.canonical("h:2/r")).unwrap();
    assert!(canonical.contains("\nmin=1:2\n"), "{canonical}");
    assert_eq!(
        Command::read(&back),
        Ok(Command::Concurrency {
            min: Some(2),
            max: None
        })
    );
    // A min beside another command is kept (and signed) as it was read, and refused.
    let stray: CtlCommand =
        serde_json::from_str(r#"{"id":"a","command":"pause","issued_at":1,"by":"b","min":3}"#)
            .unwrap();
    assert_eq!(
        Command::read(&stray),
        Err(CommandError::Stray {
            command: "pause",
            field: "min"
        })
    );
    assert!(
        serde_json::to_string(&stray)
            .unwrap()
            .contains(r#""min":3"#)
    );
    let o = CtlOutcome::of(&c, recorder(), &Ok::<(), Rejected>(()), 5);
    assert_eq!(o.detail.as_deref(), Some("min=2"));
    assert!(
        String::from_utf8(o.canonical())
            .unwrap()
            .contains("detail=5:min=2")
    );
}

#[test]
fn commands_round_trip_as_json() {
    let mut c = CtlCommand::new(
        "x".into(),
        Command::Scale { processors: 4 },
        None,
        1,
        "h:1".into(),
    );
    let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
    c.sign("k", "h:2").unwrap();
    let back: CtlCommand = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
}

/// Commands as they may sit in Redis, each with what the code before the typed [`Command`]
/// made of it (the captured output of that code, not recomputed): the JSON it re-encodes to,
/// the bytes it signs for `vm:20740/r`, the JSON once signed with `s3cret` for that target,
/// and the JSON of its `executed` and `failed` outcomes recorded by `vm:20740` (run `r`) at
/// 1795239400 with the secret `s3cret`. The first nine are what `warren ctl` sends; the rest
/// are what only a hand in Redis writes: unknown names, missing or stray numbers, a drain
/// for one pipeline, unknown fields, the sequence form serde also reads.
#[rustfmt::skip]
const BEFORE: [[&str; 6]; 21] = [
    [
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"2a4c271339e74d0ced371acf9973e088249eaeed262c8e9d797f59f550034679\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"ae4e7ceb445de44b455c6897c413ddcb62e39da1cc23504b1bac3858d681d34a\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"9cd3f5e94ab1eacfb15f4e8a81fe105ff696ecd7c2abb5a5cc1a00c1fda5c51a\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=0:\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"226d73325fe588b23392f037361d5bfcc29fedbc6d8707474ca42d9e6c290575\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"9a6c21bb36d4f23870780781a3227ec9586d15731952b15d40eaaa961aa64c8f\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"8767d9c5c21ac40cf752ea30fe28e9fd599cab6e23c6c0237f1f75126db579c6\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=6:resume\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"7f05c8a79a3c9816cf25814bedfb6d7cfe05c44ad91d68dda5961eb5e77cc3b4\"}",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"e9be57e1836e7cc462e80bac73f591cdfbb06dfcd0d5feff82219c42f2c60b16\"}",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"3fa270f166e09a757fcb4f8e6bfb9146b76f8904d05d710a4f564a407907cefe\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=6:resume\nprocessors=0:\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"7e7568525048e4fb4c8ca7ebfc6ae588acd21cfb2163499bc843b9b6f206d23d\"}",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"26794961f70fbaa945f92b760bfed4f8de81907e74acd3afe3de8f1ce0e366a4\"}",
        "{\"id\":\"0b8f\",\"command\":\"resume\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a4e2fe80faddf1f900fcd42798942cde755380d986c5cbacf61e2d11863136c3\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:drain\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"bbfa8fc9bd891832335f36f6056ac37927464108c3e85fff5f92459cf41f46da\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"18d89cd1000f03c9f54bd2318ea71574a36ceffbb5a9a984a6fc9205012ca9e7\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"98c5e61e8160a6074c70be5b2e61001df82123be336efbf7660192c40ba06c37\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:4\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"776a4b8667931959f0f0ebc536aa5084f400001af0adccefb09b11cbfaef668d\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"ae5db5499de1f37b026944bd0c34028dff95706619aa888f51a9bad990fec3cc\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":4,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"480fc587045b7507ea0d8145d5fc4263c4d1678c48ac7b5699f48107cdc367cb\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=3:256\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"8ae740e21bfa5219ad90a54f60991f6cf3274ae5df98c333cfd830e93307843b\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"906d2c53e6e99fd8b7176d70b8a89988ee2caab5036306871e97db69cccb8160\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":256,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a7aabd1457814c38429d98d5aa775e7a4c29abcc4a5a49e92917a383d2715eed\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:500\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"e23b9adcd3cb44fdec8ba8317dcab10282084082388e70961c91e1c0af93c10c\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a4933ba4cfd0662414661eb743958c8b792ef7211b08801e9c7d50b6ce133818\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":500,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"000f259a936c5e968a1a26f701d21014ffc5edd84be51c113ace72721c237fcb\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=1:0\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"c71521fabe47e4045ffbaa2cf842894d70f2a0aa85d1669e10a5286d613a4b7a\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"7b1a8a5a589cb7df841a1ca45293043f0209a916194090163286b80fd0256b32\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":0,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"f8e8a560ff5c0f280264260094b0b0dc25df577167f9d012b4c62f53706aacb6\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=6:reboot\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"5ec978a3641638f1b3e0796723d4f44a7e20b2be10780a16630efcfd875b90c6\"}",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"4e21ef9c9967ec6082b16a602356a47954bb71575b1917c200f456a83b94bb7c\"}",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"345ecc5aa19607990f9268de4e3deb66e431d0870f41c280f0a960f14f398255\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=6:reboot\nprocessors=1:3\nrate=1:9\npipeline=1:p\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"63bdb37ebcddba986cbf33c934d5e0d3714906c87afe53709a2bd87129e666eb\"}",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a441cf7fa5f9f4077771c217b0145afc4e904af96b99032c9c573af25c037cf5\"}",
        "{\"id\":\"0b8f\",\"command\":\"reboot\",\"processors\":3,\"rate\":9,\"pipeline\":\"p\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"f477abb511530c99818e12800df553ab02771d074dfc3312ee980de5b571665c\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"32c35eea0b7de84f7e43cabaa41faeb3a931337aa33d9afd3753121ed5082a10\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"52ff1e826f14d48ea5caf3fc08f186df2bd4d98a44d2f902f0c5c02710a1ea66\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"1f4720e151f6cc6104c2d820b6ac34ac417f693ab1fee3e1e121ca48a62eb656\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=1:3\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"1e92b21f2e4b70999cd2c45ee022047136a195185094cf52baee19d255064ea9\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"6eac7bc8011ec09d871100a3fdcae5fd3313596e418a887c162378240dd8dd75\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"processors\":3,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"ded21676b8cfcddf970e5f451713992181d2af20c669d93d8a3739d23c345a2b\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=1:4\nrate=1:9\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"29c8600601c49d1b68e6d0f4337d5598075222e665338026047ca7e6da469cb1\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"aa3f7c2ea3641ccb128d377a8fe8c029c323bec5e5afccfb93bb83e5010d4e58\"}",
        "{\"id\":\"0b8f\",\"command\":\"pause\",\"processors\":4,\"rate\":9,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"46334d80f1f6b05d971773c14a898afdda07a15062cd42d381b97a2e989969c5\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:2\nrate=1:7\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"bc1702e659ccb609e01d78c51afc750d17db8058484c190415b1fe50dd86e79e\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"90509dcdbf0b36603cf954d7f352dbddede32700681c76570cc705bf17c3212b\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":2,\"rate\":7,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"58bf3717d5c3dd5c75198ebd2060c93b038ba9d27960d0fb669df3be12f6ac28\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:drain\nprocessors=0:\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"d09841b6ae3a5a2a24c29fee38458b9950143be0515745804b42e60ab882c9d5\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"161c73d4ca24aa9432e45e6bcb67f512e65942de151d93e60b9601b35b0c2398\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\",\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"07920bf381555014ad2036a92eb72e748943e4aa092845b31b49bdc2cdea32e5\"}",
    ],
    [
        "{\"signature\":\"AB\",\"target\":\"vm:1\",\"x\":1,\"by\":\"ops:42\",\"issued_at\":1795239346,\"command\":\"scale\",\"processors\":1,\"id\":\"0b8f\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:1\",\"signature\":\"AB\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:1\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"9f3151aa4eb3b966fe5459f1096ac5b9a9421618163bd682510f0f7916a7d1a5\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"d7cfe0a7994142d393dca3efea7697dbea34afe252d0b2a3050aab9d519a8041\"}",
        "{\"id\":\"0b8f\",\"command\":\"scale\",\"processors\":1,\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"a902bbfdb676c6e3be4e10c0923cbb9c9b4d200652cbe2b7a2104827fef1965d\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"Pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"Pause\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:Pause\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"Pause\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"0fdddb074999e7d5407dbf3008d22be4d20686bb8f08aed796f93bda4d79adb0\"}",
        "{\"id\":\"0b8f\",\"command\":\"Pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"9d241b4db7f293a884f3035318522c11141e0e04df5443fbcf8dbf670c5fb4d1\"}",
        "{\"id\":\"0b8f\",\"command\":\"Pause\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"434999b4454cce3b76b9c51253a53b80723c141c08dcd7d753562bae6d7d26ec\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=0:\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"1ca36774cb3d3922879bd4af71a3dcd9998d2fd7c2d02276f639f1cf76ccefba\"}",
        "{\"id\":\"0b8f\",\"command\":\"\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"1a43c020b82e65f7ca8082a435322aaea369592068f763f2287091af203b3520\"}",
        "{\"id\":\"0b8f\",\"command\":\"\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"b48bc1de1ac8e6e8b45448ea25b1aa40bb8442cd4131cb5be14bb8e938dd3d31\"}",
    ],
    [
        "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"processors\":null,\"rate\":null,\"pipeline\":null,\"target\":null,\"signature\":null,\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=7:drain\n\u{1b}\nprocessors=0:\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"7d115c8ec38cbac48053443b6f00eb73a34c25c8589184b422a647fa34815635\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"da298f919e7300f367ecbc0b2a73ffe2c89fbccdd1d4a03f8e16f700c06e48a5\"}",
        "{\"id\":\"0b8f\",\"command\":\"drain\\n\\u001b\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"8ff780c6901e7fab364b8af6c0dd57948fbe3fe2f72e56208507f8003ba44b91\"}",
    ],
    [
        "[\"0b8f\",\"rate\",null,250,\"orders\",1795239346,\"ops:42\"]",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\"}",
        "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:250\npipeline=6:orders\nissued_at=10:1795239346\nby=6:ops:42\ntarget=10:vm:20740/r\n",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"issued_at\":1795239346,\"by\":\"ops:42\",\"target\":\"vm:20740/r\",\"signature\":\"652e3870c0782472d858cdd6cbc10625948b4f4677fa49e832f71c23c90e89f7\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"executed\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"c30987945dc16d488ae38fd5524295ff52a9c217e747e2f47d3797cdf8b7926e\"}",
        "{\"id\":\"0b8f\",\"command\":\"rate\",\"rate\":250,\"pipeline\":\"orders\",\"host\":\"vm\",\"pid\":20740,\"outcome\":\"failed\",\"error\":\"x\",\"at\":1795239400,\"run\":\"r\",\"signature\":\"e4dfb7252d47a5a6e21c0367a296ac05bb303c776d34c6372e45819f7721cffc\"}",
    ],
];

/// What each of [`BEFORE`] reads as: the command, or why it is malformed (the code before the
/// typed errors read the malformed ones as variants of `Command` and refused them when applied).
fn read_as() -> [Result<Command, CommandError>; 21] {
    use CommandError::*;
    let unknown = |name: &str| Err(Unknown(name.into()));
    let stray = |command, field| Err(Stray { command, field });
    [
        Ok(Command::Pause),
        Ok(Command::Pause),
        Ok(Command::Resume),
        Ok(Command::Resume),
        Ok(Command::Drain),
        Ok(Command::Scale { processors: 4 }),
        Ok(Command::Scale { processors: 256 }),
        Ok(Command::Rate { per_s: 500 }),
        Ok(Command::Rate { per_s: 0 }),
        unknown("reboot"),
        unknown("reboot"),
        Err(ScaleWithoutProcessors),
        Err(RateWithoutLimit),
        stray("pause", "processors"),
        stray("scale", "rate"),
        Err(DrainOnePipeline),
        Ok(Command::Scale { processors: 1 }),
        unknown("Pause"),
        unknown(""),
        unknown("drain\n\u{1b}"),
        Ok(Command::Rate { per_s: 250 }),
    ]
}

fn recorder() -> Recorder<'static> {
    Recorder {
        host: "vm",
        pid: 20740,
        run: "r",
    }
}

#[test]
fn every_command_keeps_the_json_signed_bytes_and_outcomes_of_before() {
    let guard = Guard::new("s3cret", "vm:20740/r".into());
    for ([raw, json, canonical, signed, executed, failed], command) in BEFORE.iter().zip(read_as())
    {
        let c: CtlCommand = serde_json::from_str(raw).unwrap();
        assert_eq!(Command::read(&c), command, "{raw}");
        assert_eq!(serde_json::to_string(&c).unwrap(), *json, "{raw}");
        assert_eq!(
            String::from_utf8(c.canonical("vm:20740/r")).unwrap(),
            *canonical,
            "{raw}"
        );
        let mut s = c.clone();
        s.sign("s3cret", "vm:20740/r").unwrap();
        assert_eq!(serde_json::to_string(&s).unwrap(), *signed, "{raw}");
        // Signed by the code before, it verifies, and survives a round trip unchanged.
        let back: CtlCommand = serde_json::from_str(signed).unwrap();
        assert_eq!(back, s, "{raw}");
        assert!(back.signature_matches("s3cret", "vm:20740/r"), "{raw}");
        assert_eq!(
            Guard::new("s3cret", "vm:20740/r".into()).check(&back, 1_795_239_346),
            Ok(()),
            "{raw}"
        );
        for (failed_with, expected) in [(None, executed), (Some("x"), failed)] {
            let mut o = CtlOutcome::of(&c, recorder(), &Ok::<(), Rejected>(()), 1_795_239_400);
            if let Some(error) = failed_with {
                // What the code before recorded for a command failed with the error "x".
                (o.outcome, o.error) = ("failed".into(), Some(error.into()));
            }
            guard.sign(&mut o);
            assert_eq!(serde_json::to_string(&o).unwrap(), *expected, "{raw}");
            assert!(o.verifies("s3cret"), "{raw}");
        }
    }
}

#[test]
fn ctl_builds_the_commands_it_always_built() {
    let built = [
        (Command::Pause, None),
        (Command::Pause, Some("orders")),
        (Command::Resume, None),
        (Command::Resume, Some("orders")),
        (Command::Drain, None),
        (Command::Scale { processors: 4 }, None),
        (Command::Scale { processors: 256 }, Some("orders")),
        (Command::Rate { per_s: 500 }, None),
        (Command::Rate { per_s: 0 }, Some("orders")),
    ];
    for ((command, pipeline), [_, json, _, signed, ..]) in built.into_iter().zip(BEFORE) {
        let mut c = CtlCommand::new(
            "0b8f".into(),
            command,
            pipeline.map(String::from),
            1_795_239_346,
            "ops:42".into(),
        );
        assert_eq!(serde_json::to_string(&c).unwrap(), json);
        c.sign("s3cret", "vm:20740/r").unwrap();
        assert_eq!(serde_json::to_string(&c).unwrap(), signed);
    }
}

#[test]
fn numbers_that_are_not_the_commands_own_are_kept_and_signed_but_refused() {
    let c: CtlCommand = serde_json::from_str(BEFORE[13][0]).unwrap();
    assert_eq!((c.processors, c.rate), (Some(4), Some(9)));
    assert_eq!(
        Command::read(&c).unwrap_err().to_string(),
        "pause takes no processors"
    );
    let mut signed = c.clone();
    signed.sign("k", "vm:1").unwrap();
    let mut dropped = signed.clone();
    dropped.processors = None;
    assert!(
        !dropped.signature_matches("k", "vm:1"),
        "a stray number is signed"
    );
    let o = CtlOutcome::of(
        &c,
        recorder(),
        &Err::<(), Rejected>(Command::read(&c).unwrap_err().into()),
        1,
    );
    assert_eq!(o.error.as_deref(), Some("pause takes no processors"));
    assert_eq!((o.processors, o.rate), (Some(4), Some(9)), "shown as read");
}

/// Review R35g F1: a forged command's id, name and pipeline (2 MB, 1 MB) were stored in the
/// history whole, and `warren ctl history` printed them; capped as a log line shows them.
#[test]
fn an_outcome_caps_what_the_command_carried() {
    let mut c = sample();
    c.id = "I".repeat(2_000_000);
    c.command = "pause".repeat(200_000);
    c.pipeline = Some("p".repeat(100_000));
    let error = Rejected::from(Refusal::Unsigned);
    let o = CtlOutcome::of(&c, recorder(), &Err(error), 1);
    let max = crate::text::SHOWN_MAX;
    assert!(o.id.len() <= max && o.id.starts_with("III") && o.id.ends_with('…'));
    assert!(o.command.len() <= max);
    assert!(o.pipeline.as_deref().is_some_and(|p| p.len() <= max));
    assert!(o.error.as_deref().is_some_and(|e| e.len() <= max));
    // A command as `warren ctl` sends it (a UUID id) is recorded as it is.
    let c = sample();
    assert_eq!(
        CtlOutcome::of(&c, recorder(), &Ok::<(), Rejected>(()), 1).id,
        c.id
    );
}

#[test]
fn outcomes_carry_the_typed_errors_text() {
    let c = sample();
    let refused = Rejected::from(Refusal::Unsigned);
    let o = CtlOutcome::of(&c, recorder(), &Err(refused.clone()), 1);
    assert_eq!(o.outcome, "failed");
    assert_eq!(o.error, Some(refused.to_string()));
    assert!(
        refused
            .to_string()
            .starts_with(crate::registry::REFUSED_UNSIGNED)
    );
}

#[test]
fn names_are_the_wire_names() {
    for (command, name) in [
        (Command::Pause, "pause"),
        (Command::Resume, "resume"),
        (Command::Drain, "drain"),
        (Command::Reload, "reload"),
        (Command::Scale { processors: 3 }, "scale"),
        (Command::Rate { per_s: 3 }, "rate"),
        (
            Command::Concurrency {
                min: None,
                max: Some(2),
            },
            "concurrency",
        ),
    ] {
        assert_eq!(command.name(), name);
        assert_eq!(command.to_string(), name);
    }
}

#[test]
fn unreadable_commands_are_refused_with_the_messages_of_before() {
    for (raw, message) in [
        (
            "42",
            "invalid type: integer `42`, expected struct CtlCommand at line 1 column 2",
        ),
        ("{}", "missing field `id` at line 1 column 2"),
        (
            "{\"id\":\"a\",\"command\":5,\"issued_at\":1,\"by\":\"b\"}",
            "invalid type: integer `5`, expected a string at line 1 column 21",
        ),
        (
            "{\"id\":\"a\",\"command\":\"scale\",\"processors\":-1,\"issued_at\":1,\"by\":\"b\"}",
            "invalid value: integer `-1`, expected usize at line 1 column 43",
        ),
        (
            "[1]",
            "invalid type: integer `1`, expected a string at line 1 column 2",
        ),
        (
            "{\"id\":\"a\",\"command\":\"scale\",\"processors\":\"4\",\"issued_at\":1,\"by\":\"b\"}",
            "invalid type: string \"4\", expected usize at line 1 column 44",
        ),
    ] {
        let e = serde_json::from_str::<CtlCommand>(raw).unwrap_err();
        assert_eq!(e.to_string(), message);
    }
}

#[test]
fn commands_of_older_ctls_still_parse() {
    let c: CtlCommand =
        serde_json::from_str(r#"{"id":"x","command":"pause","issued_at":5,"by":"h:1"}"#).unwrap();
    assert_eq!((c.target, c.signature), (None, None));
}

#[test]
fn the_signature_covers_the_pipeline_and_leaves_older_commands_alone() {
    let plain = sample();
    assert!(
        !String::from_utf8(plain.canonical("vm:1"))
            .unwrap()
            .contains("pipeline"),
        "a command without --pipeline signs as before"
    );
    let mut c = sample();
    c.pipeline = Some("orders".into());
    assert!(
        String::from_utf8(c.canonical("vm:1"))
            .unwrap()
            .contains("\npipeline=6:orders\n")
    );
    c.sign("k", "vm:1/r").unwrap();
    assert!(c.signature_matches("k", "vm:1/r"));
    let mut moved = c.clone();
    moved.pipeline = Some("users".into());
    assert!(!moved.signature_matches("k", "vm:1/r"), "pipeline changed");
    let mut widened = c.clone();
    widened.pipeline = None;
    assert!(
        !widened.signature_matches("k", "vm:1/r"),
        "pipeline dropped"
    );
}

fn sample() -> CtlCommand {
    CtlCommand::new(
        "0b8f".into(),
        Command::Scale { processors: 4 },
        None,
        1_795_239_346,
        "ops:42".into(),
    )
}

#[test]
fn the_canonical_encoding_and_signature_are_the_documented_ones() {
    let c = sample();
    assert_eq!(
        String::from_utf8(c.canonical("vm:20740")).unwrap(),
        "warren-ctl-v1\nid=4:0b8f\ncommand=5:scale\nprocessors=1:4\n\
         issued_at=10:1795239346\nby=6:ops:42\ntarget=8:vm:20740\n"
    );
    // Computed independently (Python's hmac module over the bytes above).
    let mut signed = c.clone();
    signed.sign("s3cret", "vm:20740").unwrap();
    assert_eq!(signed.target.as_deref(), Some("vm:20740"));
    assert_eq!(
        signed.signature.as_deref(),
        Some("6c14c808b9ddffaed54779e9a952a26961fa099c52957be11545e8033fd069ce")
    );
    assert!(signed.signature_matches("s3cret", "vm:20740"));
    let mut upper = signed.clone();
    upper.signature = upper.signature.map(|s| s.to_uppercase());
    assert!(upper.signature_matches("s3cret", "vm:20740"));
}

#[test]
fn the_signature_covers_every_field_and_the_target() {
    let mut signed = sample();
    signed.sign("k", "vm:1").unwrap();
    assert!(signed.signature_matches("k", "vm:1"));
    assert!(!signed.signature_matches("other", "vm:1"), "another secret");
    assert!(!signed.signature_matches("k", "vm:2"), "another target");
    let altered: [fn(&mut CtlCommand); 6] = [
        |c| c.id.push('x'),
        |c| c.command = "drain".into(),
        |c| c.processors = Some(5),
        |c| c.processors = None,
        |c| c.issued_at += 1,
        |c| c.by = "someone:1".into(),
    ];
    for (i, alter) in altered.iter().enumerate() {
        let mut c = signed.clone();
        alter(&mut c);
        assert!(!c.signature_matches("k", "vm:1"), "alteration {i} verified");
    }
    // Field boundaries cannot be moved: "ab" + "c" differs from "a" + "bc".
    let (mut a, mut b) = (sample(), sample());
    (a.id, a.command) = ("ab".into(), "c".into());
    (b.id, b.command) = ("a".into(), "bc".into());
    assert_ne!(a.canonical("t"), b.canonical("t"));
    for bad in ["", "zz", "abc", "6c14"] {
        let mut c = signed.clone();
        c.signature = Some(bad.into());
        assert!(!c.signature_matches("k", "vm:1"), "{bad:?}");
    }
}

#[test]
fn the_rate_joins_the_signed_encoding_only_when_present() {
    let mut c = sample();
    (c.command, c.processors, c.rate) = ("rate".into(), None, Some(500));
    assert_eq!(
        String::from_utf8(c.canonical("vm:1")).unwrap(),
        "warren-ctl-v1\nid=4:0b8f\ncommand=4:rate\nprocessors=0:\nrate=3:500\n\
         issued_at=10:1795239346\nby=6:ops:42\ntarget=4:vm:1\n"
    );
    c.sign("k", "vm:1").unwrap();
    for altered in [Some(5000), Some(0), None] {
        let mut other = c.clone();
        other.rate = altered;
        assert!(!other.signature_matches("k", "vm:1"), "{altered:?}");
    }
    assert!(c.signature_matches("k", "vm:1"));
}

fn signed(id: &str, issued_at: u64, secret: &str, target: &str) -> CtlCommand {
    let mut c = sample();
    c.id = id.into();
    c.issued_at = issued_at;
    c.sign(secret, target).unwrap();
    c
}

#[test]
fn the_guard_refuses_unsigned_forged_stale_future_replayed_and_redirected_commands() {
    let now = 1_000_000;
    let mut guard = Guard::new("k", "vm:1".into());
    assert_eq!(guard.check(&signed("a", now, "k", "vm:1"), now), Ok(()));
    // The edges of the window are accepted.
    assert_eq!(
        guard.check(&signed("b", now - 120, "k", "vm:1"), now),
        Ok(())
    );
    assert_eq!(
        guard.check(&signed("c", now + 120, "k", "vm:1"), now),
        Ok(())
    );

    let refused = |guard: &mut Guard, c: &CtlCommand| guard.check(c, now).unwrap_err().to_string();
    let e = refused(&mut guard, &sample());
    assert!(
        e.starts_with(REFUSED_UNSIGNED) && e.contains("CONTROL_SECRET"),
        "{e}"
    );
    let e = refused(&mut guard, &signed("d", now, "wrong", "vm:1"));
    assert!(e.starts_with(REFUSED_BAD_SIGNATURE), "{e}");
    let e = refused(&mut guard, &signed("e", now - 121, "k", "vm:1"));
    assert!(e.contains("stale") && e.contains("121 s ago"), "{e}");
    let e = refused(&mut guard, &signed("f", now + 121, "k", "vm:1"));
    assert!(e.contains("future") && e.contains("121 s"), "{e}");
    let e = refused(&mut guard, &signed("a", now, "k", "vm:1"));
    assert!(e.contains("replay") && e.contains('a'), "{e}");
    // Signed for another instance: its target says so; without the field the signature
    // still does not verify.
    let mut other = signed("g", now, "k", "vm:2");
    let e = refused(&mut guard, &other);
    assert!(e.contains("addressed to vm:2"), "{e}");
    other.target = None;
    assert!(refused(&mut guard, &other).starts_with(REFUSED_BAD_SIGNATURE));
    // Refusals do not mark an id as seen; a valid copy still goes through once.
    assert_eq!(guard.check(&signed("d", now, "k", "vm:1"), now), Ok(()));

    // Ids are forgotten only once a copy would be refused as stale anyway.
    let later = now + 241;
    assert!(
        guard
            .check(&signed("a", now, "k", "vm:1"), later)
            .unwrap_err()
            .to_string()
            .contains("stale")
    );
    assert_eq!(guard.check(&signed("h", later, "k", "vm:1"), later), Ok(()));
    assert!(!guard.seen.contains_key("a"));
}

#[test]
fn a_command_signed_for_an_earlier_run_of_the_same_host_and_pid_is_refused() {
    let now = 1_000_000;
    // The first process, PID 1 in its container, accepts a command signed for its run...
    let mut first = Guard::new("k", "vm:1/run-a".into());
    let captured = signed("a", now, "k", "vm:1/run-a");
    assert_eq!(first.check(&captured, now), Ok(()));
    // ...the process after a restart (same host, same PID, empty memory of ids) does not,
    // nor a command signed for the bare `host:pid` (as captured before runs existed).
    let mut second = Guard::new("k", "vm:1/run-b".into());
    let e = second.check(&captured, now + 15).unwrap_err().to_string();
    assert!(
        e.contains("addressed to vm:1/run-a") && e.contains("another run"),
        "{e}"
    );
    let e = second
        .check(&signed("b", now, "k", "vm:1"), now)
        .unwrap_err()
        .to_string();
    assert!(e.contains("another run"), "{e}");
    // Its target rewritten to this run: the signature does not verify.
    let mut redirected = captured.clone();
    redirected.target = Some("vm:1/run-b".into());
    assert!(
        second
            .check(&redirected, now)
            .unwrap_err()
            .to_string()
            .starts_with(REFUSED_BAD_SIGNATURE)
    );
    assert_eq!(
        second.check(&signed("c", now, "k", "vm:1/run-b"), now),
        Ok(())
    );
    // Without a secret, the bare `host:pid` of older `warren ctl`s still reaches it.
    let mut open = Guard::new("", "vm:1/run-b".into());
    assert_eq!(open.check(&signed("d", now, "", "vm:1"), now), Ok(()));
}

#[test]
fn outcomes_are_signed_over_every_field_and_verified() {
    let guard = Guard::new("k", "vm:1/r".into());
    let mut o = CtlOutcome {
        id: "0b8f".into(),
        command: "pause".into(),
        processors: None,
        rate: None,
        pipeline: None,
        detail: None,
        host: "vm".into(),
        pid: 1,
        outcome: "executed".into(),
        error: None,
        at: 1_795_239_346,
        run: Some("r".into()),
        signature: None,
    };
    assert_eq!(
        String::from_utf8(o.canonical()).unwrap(),
        "warren-outcome-v1\nid=4:0b8f\ncommand=5:pause\nprocessors=0:\nrate=0:\nhost=2:vm\n\
         pid=1:1\nrun=1:r\noutcome=8:executed\nerror=0:\nat=10:1795239346\n"
    );
    assert!(!o.verifies("k"), "unsigned");
    guard.sign(&mut o);
    assert!(o.verifies("k"));
    assert!(!o.verifies("other"));
    let altered: [fn(&mut CtlOutcome); 6] = [
        |o| o.outcome = "failed".into(),
        |o| o.error = Some("x".into()),
        |o| o.pid = 2,
        |o| o.run = None,
        |o| o.at += 1,
        |o| o.id.push('x'),
    ];
    for alter in altered {
        let mut copy = o.clone();
        alter(&mut copy);
        assert!(!copy.verifies("k"), "{copy:?}");
    }
    let mut unsigned = o.clone();
    Guard::new("", "vm:1/r".into()).sign(&mut unsigned);
    assert!(
        unsigned.signature == o.signature,
        "no secret leaves it as it was"
    );
}

#[test]
fn without_a_secret_every_command_is_accepted_as_before() {
    let mut guard = Guard::new("", "vm:1".into());
    assert_eq!(guard.check(&sample(), 0), Ok(()));
    assert_eq!(guard.check(&sample(), u64::MAX / 2), Ok(()));
    assert_eq!(guard.check(&signed("x", 0, "whatever", "vm:1"), 0), Ok(()));
    let e = guard
        .check(&signed("x", 0, "k", "vm:2"), 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("addressed to vm:2"), "{e}");
}

/// `reload` reads the whole configuration again: it is the instance's, never one pipeline's,
/// and carries no number; `warren ctl reload` builds it so, and it signs like every command.
#[test]
fn reload_is_the_whole_instance_and_takes_nothing() {
    let read = |raw: &str| Command::read(&serde_json::from_str::<CtlCommand>(raw).unwrap());
    assert_eq!(
        read(r#"{"id":"a","command":"reload","issued_at":1,"by":"b"}"#),
        Ok(Command::Reload)
    );
    assert_eq!(
        read(r#"{"id":"a","command":"reload","pipeline":"orders","issued_at":1,"by":"b"}"#),
        Err(CommandError::ReloadOnePipeline)
    );
    assert_eq!(
        read(r#"{"id":"a","command":"reload","processors":2,"issued_at":1,"by":"b"}"#),
        Err(CommandError::Stray {
            command: "reload",
            field: "processors"
        })
    );
    let mut c = CtlCommand::new("0b8f".into(), Command::Reload, None, 1, "ops:42".into());
    assert_eq!(
        serde_json::to_string(&c).unwrap(),
        r#"{"id":"0b8f","command":"reload","issued_at":1,"by":"ops:42"}"#
    );
    c.sign("s3cret", "vm:20740/r").unwrap();
    assert!(c.signature_matches("s3cret", "vm:20740/r"));
    assert!(!c.signature_matches("other", "vm:20740/r"));
}
